"""
The chat web server behind `python -m nanochat_fast.scripts.chat_web`: app.py (routes), pool.py (the
replicas), replica_process.py (a replica in a process of its own), static/ (the page, nothing loaded from
elsewhere). FastAPI and uvicorn are an extra: pip install -e ".[web]".
"""

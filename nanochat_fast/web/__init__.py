"""
The chat web server behind `python -m nanochat_fast.scripts.chat_web`: app.py (the FastAPI routes and
what a request may contain), pool.py (the replicas, a worker thread each driving its engine, fed from one
bounded queue), replica_process.py (a replica's engine in a process of its own), static/ (the page: plain
HTML, CSS and JS, nothing loaded from elsewhere). FastAPI and uvicorn are an extra: pip install -e ".[web]".
"""

"""
The chat web server behind `python -m nanochat_fast.scripts.chat_web`:

    pool.py     model replicas, one worker thread each driving one engine that decodes many replies
                at once, fed from one bounded queue
    stats.py    what /stats counts: outcomes, tokens/s over the decode time, time to first token
    schema.py   what a chat request may contain (pydantic), and the one-line reasons when it is wrong
    app.py      the FastAPI routes: the page, /health, /stats, POST /chat/completions (server-sent events)
    static/     the page itself: plain HTML, CSS and JS, no build step, nothing loaded from elsewhere

FastAPI and uvicorn are an optional extra: `pip install -e ".[web]"`.
"""

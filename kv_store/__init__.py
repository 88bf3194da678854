"""The shared KV store: blocks of prefix KV kept for every engine (kv_store/store.py,
kv_store/server.py)."""

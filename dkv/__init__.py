"""dKV: a distributed peer-to-peer KV-cache store for LLM serving.

The ``dkv`` package holds the node and its client library. It never imports
``connector`` or ``cluster`` (a test enforces that arrow).
"""

__version__ = "0.1.0"

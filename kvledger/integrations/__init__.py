"""kvledger under other serving engines' own code.

``kvledger.integrations.vllm``: a block pool vLLM's KV cache manager runs on,
recording every page transition in a kvledger ``Ledger`` (the ``vllm`` extra).

Nothing here is imported by ``import kvledger``; each integration imports its
engine only when it is used.
"""

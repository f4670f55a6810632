"""R8's models (tests/core/test_state_machine.py): what the hypothesis state machine holds the ledger to.

    model          the reference model: SPEC's event tables written slowly and obviously
    bytes_oracle   the semantic oracle: page contents, zero before first read (Bytes)
    invalid        invalid commands and the error each must raise (invalid_commands)
    prefix         the prefix-cache rules (PrefixRules: publish, lookup, share, evict)
"""

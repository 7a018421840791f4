"""branch-settlement: settles the capacity that parallel AI workflows reserve.

One installed namespace; the repository's folders are its packages, layered from the bottom up (each folder's
`__init__` says what it may import, and tests/test_layers.py checks it):

    branch_settlement.errors        the one error root (this folder)
    branch_settlement.schemas       schemas/: the Avro schemas and the codec (wire format, canonical JSON)
    branch_settlement.projections   projections/: the ledger's records, the store and the view the fold works on
    branch_settlement.processors    processors/:
        ledger/      the pure fold: validation, handlers, accounting, results, outputs and their routing
        replay/      offline replay of files and exported partitions
        kafka/       the processor runtime: checkpoint sequence, restore, clients, config, metrics
        crosscheck/  the committed topics compared with a re-fold (`settle replay --topic`)
        audit/       one parent's story for people (`settle audit`)
        cli/         `settle`
"""

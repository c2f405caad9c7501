"""Applications built on the library, outside its core: the demo, the experiments that
reproduce the papers' tables, benchmarks and plotting. Scripts in ``scripts/`` are thin
wrappers over these."""

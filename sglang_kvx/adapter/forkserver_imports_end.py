"""Last of the forkserver's preloaded modules: collection back on, and the imported objects frozen
(``gc.freeze``: moved to a generation no collection scans, which is what CPython offers for a process
that forks workers) -- each child starts with the collector on, as a spawned child would, without
rescanning the modules it inherited."""

import gc

gc.enable()
gc.freeze()

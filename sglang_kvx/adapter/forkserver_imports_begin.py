"""First of the forkserver's preloaded modules (``plugin._register_cpu_forkserver``): no cyclic garbage
collection while SGLang's modules are imported. CPython's default thresholds run a full collection
over the growing heap again and again during an import this large: about a quarter of the import's
CPU time on this machine (scheduler module: 10.6 against 14.1 user seconds). Nothing is garbage there:
every object the imports make lives as long as the process."""

import gc

gc.disable()

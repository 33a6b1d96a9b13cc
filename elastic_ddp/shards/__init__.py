"""Sharded datasets in object storage (or any fsspec storage), served through the global cursor.

- :mod:`~elastic_ddp.shards.index`: ``index.json`` beside the shards (sizes, digests, where samples lie);
- :mod:`~elastic_ddp.shards.cache`: the node-local piece cache (budget, eviction, one download per node,
  verified on fill);
- :mod:`~elastic_ddp.shards.dataset`: :class:`TokenWindows` and :class:`TarSamples`, map-style datasets;
- :mod:`~elastic_ddp.shards.prefetch`: fetching ahead what this rank's next steps read.

docs/guide.md, "Data in object storage", shows both paths; docs/design.md, "Sharded data", the design.
"""

from elastic_ddp.shards.cache import CacheFullError, ShardCache, ShardIntegrityError
from elastic_ddp.shards.dataset import ShardedDataset, ShardReader, TarSamples, TokenWindows, default_cache_dir
from elastic_ddp.shards.index import INDEX_NAME, ShardIndex, build_index, load_index
from elastic_ddp.shards.prefetch import Prefetcher

__all__ = [
    "INDEX_NAME",
    "CacheFullError",
    "Prefetcher",
    "ShardCache",
    "ShardIndex",
    "ShardIntegrityError",
    "ShardReader",
    "ShardedDataset",
    "TarSamples",
    "TokenWindows",
    "build_index",
    "default_cache_dir",
    "load_index",
]

"""The storage tier under the RAM pools (see ``cache.storage.tier``)."""

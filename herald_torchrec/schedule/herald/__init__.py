"""Herald's planner: Location-Aware Input Allocation (laia), adaptive table selection (tables), guest eviction
(eviction) and on-demand synchronisation with lookahead, put together in `planner.HeraldPolicy`."""

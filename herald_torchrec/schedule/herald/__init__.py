"""Herald's planner: Location-Aware Input Allocation (laia), adaptive table selection (tables), guest eviction
(eviction), the planning budget (budget) and on-demand synchronisation with lookahead, put together in
`planner.HeraldPolicy`."""

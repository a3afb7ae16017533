"""The comparison systems' data plane, beside Herald's: rows replicated on every rank (replicas: FAE, P²RES), HET's
per-worker cache (het_cache), and what their plans add to a step (regions)."""

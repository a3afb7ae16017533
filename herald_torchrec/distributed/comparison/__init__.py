"""The comparison systems' data plane, beside Herald's step: rows replicated on every rank (replicas: FAE, P²RES) and
HET's per-worker cache (het_cache), plugged into the sharded module as step extensions (extensions)."""

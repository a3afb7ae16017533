"""One step of the sharded module, in the order it runs: the plan's exchanges prepared in numpy (prepare,
static_plan), the index layouts of the lookup (lookup_layout), the collectives as TorchRec-style dist objects
(dist_data), and one rank's rows moved, shared, pooled and updated (embedding_lookup); what a system beside Herald's
step plugs in (extension)."""

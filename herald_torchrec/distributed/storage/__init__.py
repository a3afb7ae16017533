"""Row storage: the Herald-managed tables of one rank on one FBGEMM TBE (row_store), where rows sit (row_layout), host
reads and writes of rows and optimizer state (row_access), the fused optimizer's settings (optimizer_params) and its
update with gradients summed outside the TBE (summed_update)."""

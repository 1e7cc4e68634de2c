"""The simulator against measurements: readers of the published tables, the bulk fit of
efficiency parameters, nccl-tests comparisons and the error report (MAPE, Spearman)."""

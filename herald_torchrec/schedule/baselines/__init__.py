"""The comparison policies, planned in the same control plane as Herald: `static` (owners never move), HET
(`het_bsp`, `het`), FAE (`fae`), P²RES (`p2res`), and the published parameter-server Herald (`herald_greedy`)."""

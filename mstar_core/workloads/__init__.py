"""End-to-end workloads: what ``mstar demo`` runs."""

"""Placement policies: LeMix (ours and the paper's form), SEPARATE, MIX-RR, MIX-LUF."""

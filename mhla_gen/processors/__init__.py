"""MHLA attention processors, one module per base model (dit, sana, wan)."""

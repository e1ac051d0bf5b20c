"""How the model is reshaped for its mesh before compile (one module per technique)."""

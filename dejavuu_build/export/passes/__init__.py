"""Graph passes over our decoders, one module per pass."""

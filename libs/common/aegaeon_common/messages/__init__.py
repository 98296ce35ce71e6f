"""Message schemas, one module per channel. Structs only; no behaviour."""

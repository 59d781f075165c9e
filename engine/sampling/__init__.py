"""Next-token sampling for a batch of rows with different parameters."""

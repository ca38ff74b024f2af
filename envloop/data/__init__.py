"""Message and datum types, and the utilities that flatten and tokenize message logs."""

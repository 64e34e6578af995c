"""router: the front door (gRPC, tokenization, routing). Built in the cluster issue."""

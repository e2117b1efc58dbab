"""Training data: preparing ArrayRecord shards, and the Grain pipeline that reads them."""

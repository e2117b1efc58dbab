"""Published weights: Hugging Face Llama checkpoints in and out, and the weights directory
`train.init_from` reads."""

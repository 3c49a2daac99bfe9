"""Text handling shared by the offline Engine, batch runs, the frontend and the server: the
tokenizer, chat templates, incremental detokenization and stop strings."""

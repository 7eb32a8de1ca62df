"""The torch-free text side: checkpoint metadata, tokenizer, chat template, output parsers,
grammar compilation and incremental detokenization. Safe to import in every process."""

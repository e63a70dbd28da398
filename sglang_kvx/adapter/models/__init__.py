"""Model classes served by SGLang through its model registry (``ModelRegistry.register`` imports
every module here with an ``EntryClass``); the plugin registers this package in scheduler processes."""

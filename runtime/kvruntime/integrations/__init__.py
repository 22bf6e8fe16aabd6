"""Bridges from compiled artifacts to other libraries, each imported on request (`kvruntime.integrations.kvpress`
needs kvpress installed; nothing else in kvruntime imports these modules)."""

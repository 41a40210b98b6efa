"""Symbols: find a function in a process (resolve), read ELF symbol tables
(symtab), name addresses (symbolize, demangle, callers)."""

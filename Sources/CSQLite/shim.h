#ifndef FERRY_CSQLITE_SHIM_H
#define FERRY_CSQLITE_SHIM_H
#include <sqlite3.h>

/// sqlite3_config is variadic, which Swift cannot call. Ferry never reads SQLite's memory statistics
/// (sqlite3_memory_used, a soft heap limit), and keeping them takes a process-wide mutex on every
/// allocation SQLite makes: tens of thousands per sync session. Only effective before the first open.
static inline int ferry_sqlite3_disable_memory_statistics(void) {
    return sqlite3_config(SQLITE_CONFIG_MEMSTATUS, 0);
}
#endif

#ifndef FERRY_CDBUS_SHIM_H
#define FERRY_CDBUS_SHIM_H
#include <dbus/dbus.h>
#include <sys/eventfd.h>

/* Swift cannot import DBUS_TYPE_* (they are ((int) 'x') macros): re-export them as constants. */
static const int FERRY_DBUS_TYPE_INVALID = DBUS_TYPE_INVALID;
static const int FERRY_DBUS_TYPE_BYTE = DBUS_TYPE_BYTE;
static const int FERRY_DBUS_TYPE_BOOLEAN = DBUS_TYPE_BOOLEAN;
static const int FERRY_DBUS_TYPE_INT16 = DBUS_TYPE_INT16;
static const int FERRY_DBUS_TYPE_UINT16 = DBUS_TYPE_UINT16;
static const int FERRY_DBUS_TYPE_INT32 = DBUS_TYPE_INT32;
static const int FERRY_DBUS_TYPE_UINT32 = DBUS_TYPE_UINT32;
static const int FERRY_DBUS_TYPE_INT64 = DBUS_TYPE_INT64;
static const int FERRY_DBUS_TYPE_UINT64 = DBUS_TYPE_UINT64;
static const int FERRY_DBUS_TYPE_DOUBLE = DBUS_TYPE_DOUBLE;
static const int FERRY_DBUS_TYPE_STRING = DBUS_TYPE_STRING;
static const int FERRY_DBUS_TYPE_OBJECT_PATH = DBUS_TYPE_OBJECT_PATH;
static const int FERRY_DBUS_TYPE_SIGNATURE = DBUS_TYPE_SIGNATURE;
static const int FERRY_DBUS_TYPE_UNIX_FD = DBUS_TYPE_UNIX_FD;
static const int FERRY_DBUS_TYPE_ARRAY = DBUS_TYPE_ARRAY;
static const int FERRY_DBUS_TYPE_VARIANT = DBUS_TYPE_VARIANT;
static const int FERRY_DBUS_TYPE_STRUCT = DBUS_TYPE_STRUCT;
static const int FERRY_DBUS_TYPE_DICT_ENTRY = DBUS_TYPE_DICT_ENTRY;

/* The connection thread sleeps in poll() on libdbus's fds plus this eventfd, which callers signal when
 * they queue work. Glibc's Swift module does not export <sys/eventfd.h>, hence the wrapper. */
static inline int ferry_wakeup_eventfd(void) { return eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK); }
#endif

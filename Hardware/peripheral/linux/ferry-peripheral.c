/*
 * ferry-peripheral — a Linux Sync peripheral on BlueZ, built on the ferry_sync C library.
 *
 * Registers the Sync GATT service (DATA notify, CONTROL write/write-without-response, STREAM_INFO read)
 * with org.bluez.GattManager1 and advertises it with org.bluez.LEAdvertisingManager1, over libdbus. So a
 * second Linux box (a Pi) can be the peripheral of a Ferry gateway, with real radios, and no firmware.
 *
 *   ferry-peripheral [--adapter hci0] [--state DIR] [--generate N] [--rate R] [--stdin] [--payload-bytes B]
 *                    [--name NAME] [--notify-rate N]
 *
 * Events: --generate N appends N events at start, --rate R appends R generated events per second, --stdin
 * appends one event per input line (the line's bytes without the newline, truncated to the payload limit).
 * --state DIR keeps meta (epoch, head, deleted_through) and the event log there, so a restart resumes the
 * same stream; without it, a fresh epoch each run.
 *
 * Notifications are sent as PropertiesChanged("Value") on DATA, which bluetoothd turns into one ATT
 * notification each; their size is the MTU BlueZ reports in the CONTROL write's options (minus 3). One
 * central at a time (a Ferry gateway). Build: Hardware/peripheral/run-tests (or see README.md).
 */
#include <dbus/dbus.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../ferry_ram_store.h"
#include "../ferry_sync.h"

#define SVC_UUID "f3a70001-8a96-49d6-9124-d674293fa28b"
#define DATA_UUID "f3a70002-8a96-49d6-9124-d674293fa28b"
#define CONTROL_UUID "f3a70003-8a96-49d6-9124-d674293fa28b"
#define INFO_UUID "f3a70004-8a96-49d6-9124-d674293fa28b"
#define APP_PATH "/org/ferry/peripheral"
#define SVC_PATH APP_PATH "/service0"
#define DATA_PATH SVC_PATH "/char0"
#define CONTROL_PATH SVC_PATH "/char1"
#define INFO_PATH SVC_PATH "/char2"
#define ADV_PATH APP_PATH "/advertisement0"
#define GATT_CHR "org.bluez.GattCharacteristic1"

static volatile sig_atomic_t stop_requested;
static void on_signal(int sig) { (void)sig; stop_requested = 1; }

/* ---------------------------------------------------------------- options */

static struct {
    const char *adapter, *state_dir, *name;
    unsigned long generate;
    double rate, notify_rate;
    int from_stdin;
    unsigned payload_bytes;
} opt = {"hci0", NULL, "Ferry-C", 0, 0.0, 200.0, 0, 20};

static void usage(FILE *f) {
    fprintf(f, "usage: ferry-peripheral [--adapter hciN] [--state DIR] [--generate N] [--rate R] [--stdin]\n"
               "                        [--payload-bytes B] [--name NAME] [--notify-rate N]\n");
}

static int parse_args(int argc, char **argv) {
    int i;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) { usage(stdout); exit(0); }
        if (strcmp(a, "--stdin") == 0) { opt.from_stdin = 1; continue; }
        if (v == NULL) { fprintf(stderr, "ferry-peripheral: %s needs a value\n", a); return -1; }
        i++;
        errno = 0;
        if (strcmp(a, "--adapter") == 0) opt.adapter = v;
        else if (strcmp(a, "--state") == 0) opt.state_dir = v;
        else if (strcmp(a, "--name") == 0) opt.name = v;
        else if (strcmp(a, "--generate") == 0) opt.generate = strtoul(v, &end, 10);
        else if (strcmp(a, "--rate") == 0) opt.rate = strtod(v, &end);
        else if (strcmp(a, "--notify-rate") == 0) opt.notify_rate = strtod(v, &end);
        else if (strcmp(a, "--payload-bytes") == 0) opt.payload_bytes = (unsigned)strtoul(v, &end, 10);
        else { fprintf(stderr, "ferry-peripheral: unknown option %s\n", a); return -1; }
        if (end != NULL && (*end != '\0' || errno != 0)) {
            fprintf(stderr, "ferry-peripheral: %s: '%s' is not a number\n", a, v);
            return -1;
        }
    }
    if (opt.payload_bytes > FERRY_MAX_PAYLOAD || opt.rate < 0 || opt.notify_rate <= 0 || strlen(opt.name) > 20 ||
        strncmp(opt.adapter, "hci", 3) != 0) {
        fprintf(stderr, "ferry-peripheral: --payload-bytes must be 0..%u, rates positive, --name <= 20 bytes, "
                        "--adapter hciN\n", (unsigned)FERRY_MAX_PAYLOAD);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- storage: RAM store + files in --state */

static uint8_t ram[8u << 20];
static ferry_ram_store rs;
static int log_fd = -1;

static int write_all(int fd, const void *buf, size_t n) {
    const uint8_t *p = (const uint8_t *)buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void be64(uint8_t *p, uint64_t v) { int i; for (i = 7; i >= 0; i--) { p[i] = (uint8_t)v; v >>= 8; } }
static uint64_t rd64(const uint8_t *p) { uint64_t v = 0; int i; for (i = 0; i < 8; i++) v = (v << 8) | p[i]; return v; }

static char *state_path(const char *leaf) {
    static char buf[2][4096];
    static int which;
    which ^= 1;
    snprintf(buf[which], sizeof buf[which], "%s/%s", opt.state_dir, leaf);
    return buf[which];
}

/* The event log: records seq(8) len(2) bytes, fsynced per append. The RAM store is the index; the log is
 * replayed into it at start. Records above the persisted head were never visible and are ignored. */
static int file_append(void *ctx, uint64_t seq, const uint8_t *data, uint16_t len) {
    uint8_t hdr[10];
    int rc = ferry_ram_store_callbacks(&rs).append(ctx, seq, data, len);
    if (rc != FERRY_OK || log_fd < 0) return rc;
    be64(hdr, seq);
    hdr[8] = (uint8_t)(len >> 8);
    hdr[9] = (uint8_t)len;
    if (write_all(log_fd, hdr, sizeof hdr) != 0 || write_all(log_fd, data, len) != 0 || fsync(log_fd) != 0)
        return FERRY_ERR_STORAGE;
    return FERRY_OK;
}

static int file_delete_through(void *ctx, uint64_t seq) {
    ferry_ram_store_callbacks(&rs).delete_through(ctx, seq);
    /* Everything acknowledged: start the log afresh (deleted_through is already persisted in meta). */
    if (log_fd >= 0 && rs.count == 0 && ftruncate(log_fd, 0) != 0) return FERRY_ERR_STORAGE;
    return FERRY_OK;
}

static int file_persist(void *ctx, const ferry_meta *m) {
    uint8_t b[24];
    int fd;
    ferry_ram_store_callbacks(&rs).persist(ctx, m);
    if (opt.state_dir == NULL) return FERRY_OK;
    be64(b, m->epoch);
    be64(b + 8, m->head);
    be64(b + 16, m->deleted_through);
    /* write-to-temp + fsync + rename: a power cut leaves the old meta or the new, never half of one */
    fd = open(state_path("meta.tmp"), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return FERRY_ERR_STORAGE;
    if (write_all(fd, b, sizeof b) != 0 || fsync(fd) != 0) { close(fd); return FERRY_ERR_STORAGE; }
    close(fd);
    if (rename(state_path("meta.tmp"), state_path("meta")) != 0) return FERRY_ERR_STORAGE;
    return FERRY_OK;
}

static int load_state(ferry_meta *m) {
    uint8_t b[24], hdr[10], payload[FERRY_MAX_PAYLOAD];
    int fd;
    if (opt.state_dir == NULL) return 0;
    mkdir(opt.state_dir, 0700);
    fd = open(state_path("meta"), O_RDONLY);
    if (fd >= 0) {
        ssize_t n = read(fd, b, sizeof b);
        close(fd);
        if (n == (ssize_t)sizeof b) {
            m->epoch = rd64(b);
            m->head = rd64(b + 8);
            m->deleted_through = rd64(b + 16);
        }
    }
    log_fd = open(state_path("events.log"), O_RDWR | O_CREAT | O_APPEND, 0600);
    if (log_fd < 0) {
        fprintf(stderr, "ferry-peripheral: cannot open %s: %s\n", state_path("events.log"), strerror(errno));
        return -1;
    }
    if (m->epoch == 0) return ftruncate(log_fd, 0) == 0 ? 0 : -1; /* a new stream: the old log is not ours */
    for (;;) {
        uint16_t len;
        uint64_t seq;
        if (read(log_fd, hdr, sizeof hdr) != (ssize_t)sizeof hdr) break;
        seq = rd64(hdr);
        len = (uint16_t)((hdr[8] << 8) | hdr[9]);
        if (len > FERRY_MAX_PAYLOAD || read(log_fd, payload, len) != (ssize_t)len) break; /* torn tail */
        if (seq > m->deleted_through && seq <= m->head)
            ferry_ram_store_callbacks(&rs).append(&rs, seq, payload, len);
    }
    return 0;
}

static int random_bytes(void *ctx, uint8_t out[8]) {
    int fd = open("/dev/urandom", O_RDONLY);
    ssize_t n;
    (void)ctx;
    if (fd < 0) return FERRY_ERR_RANDOM;
    n = read(fd, out, 8);
    close(fd);
    return n == 8 ? FERRY_OK : FERRY_ERR_RANDOM;
}

/* ---------------------------------------------------------------- D-Bus plumbing */

static DBusConnection *bus;
static ferry_peripheral per;
static ferry_conn conn;
static uint16_t current_mtu = 23;
static int notifying, connected;
static unsigned notes_this_tick;

static void append_variant_string(DBusMessageIter *dict, const char *key, int type, const void *value) {
    DBusMessageIter entry, var;
    char sig[2] = {(char)type, 0};
    dbus_message_iter_open_container(dict, DBUS_TYPE_DICT_ENTRY, NULL, &entry);
    dbus_message_iter_append_basic(&entry, DBUS_TYPE_STRING, &key);
    dbus_message_iter_open_container(&entry, DBUS_TYPE_VARIANT, sig, &var);
    dbus_message_iter_append_basic(&var, type, value);
    dbus_message_iter_close_container(&entry, &var);
    dbus_message_iter_close_container(dict, &entry);
}

static void append_variant_strings(DBusMessageIter *dict, const char *key, const char **values, int n) {
    DBusMessageIter entry, var, arr;
    int i;
    dbus_message_iter_open_container(dict, DBUS_TYPE_DICT_ENTRY, NULL, &entry);
    dbus_message_iter_append_basic(&entry, DBUS_TYPE_STRING, &key);
    dbus_message_iter_open_container(&entry, DBUS_TYPE_VARIANT, "as", &var);
    dbus_message_iter_open_container(&var, DBUS_TYPE_ARRAY, "s", &arr);
    for (i = 0; i < n; i++) dbus_message_iter_append_basic(&arr, DBUS_TYPE_STRING, &values[i]);
    dbus_message_iter_close_container(&var, &arr);
    dbus_message_iter_close_container(&entry, &var);
    dbus_message_iter_close_container(dict, &entry);
}

/* Properties of one object's one interface, as a{sv}. Returns 0 if path/iface is not ours. */
static int append_props(DBusMessageIter *it, const char *path, const char *iface) {
    DBusMessageIter dict;
    const char *svc = SVC_PATH;
    dbus_bool_t yes = TRUE;
    if (strcmp(path, SVC_PATH) == 0 && strcmp(iface, "org.bluez.GattService1") == 0) {
        const char *uuid = SVC_UUID;
        dbus_message_iter_open_container(it, DBUS_TYPE_ARRAY, "{sv}", &dict);
        append_variant_string(&dict, "UUID", DBUS_TYPE_STRING, &uuid);
        append_variant_string(&dict, "Primary", DBUS_TYPE_BOOLEAN, &yes);
    } else if (strcmp(iface, GATT_CHR) == 0 &&
               (strcmp(path, DATA_PATH) == 0 || strcmp(path, CONTROL_PATH) == 0 || strcmp(path, INFO_PATH) == 0)) {
        static const char *data_flags[] = {"notify"}, *control_flags[] = {"write", "write-without-response"},
                          *info_flags[] = {"read"};
        const char *uuid = strcmp(path, DATA_PATH) == 0 ? DATA_UUID : strcmp(path, CONTROL_PATH) == 0 ? CONTROL_UUID : INFO_UUID;
        dbus_message_iter_open_container(it, DBUS_TYPE_ARRAY, "{sv}", &dict);
        append_variant_string(&dict, "UUID", DBUS_TYPE_STRING, &uuid);
        append_variant_string(&dict, "Service", DBUS_TYPE_OBJECT_PATH, &svc);
        if (strcmp(path, DATA_PATH) == 0) append_variant_strings(&dict, "Flags", data_flags, 1);
        else if (strcmp(path, CONTROL_PATH) == 0) append_variant_strings(&dict, "Flags", control_flags, 2);
        else append_variant_strings(&dict, "Flags", info_flags, 1);
    } else if (strcmp(path, ADV_PATH) == 0 && strcmp(iface, "org.bluez.LEAdvertisement1") == 0) {
        static const char *uuids[] = {SVC_UUID};
        const char *type = "peripheral";
        dbus_message_iter_open_container(it, DBUS_TYPE_ARRAY, "{sv}", &dict);
        append_variant_string(&dict, "Type", DBUS_TYPE_STRING, &type);
        append_variant_strings(&dict, "ServiceUUIDs", uuids, 1);
        append_variant_string(&dict, "LocalName", DBUS_TYPE_STRING, &opt.name);
    } else {
        return 0;
    }
    dbus_message_iter_close_container(it, &dict);
    return 1;
}

static void append_object(DBusMessageIter *objs, const char *path, const char *iface) {
    DBusMessageIter entry, ifaces, ientry;
    dbus_message_iter_open_container(objs, DBUS_TYPE_DICT_ENTRY, NULL, &entry);
    dbus_message_iter_append_basic(&entry, DBUS_TYPE_OBJECT_PATH, &path);
    dbus_message_iter_open_container(&entry, DBUS_TYPE_ARRAY, "{sa{sv}}", &ifaces);
    dbus_message_iter_open_container(&ifaces, DBUS_TYPE_DICT_ENTRY, NULL, &ientry);
    dbus_message_iter_append_basic(&ientry, DBUS_TYPE_STRING, &iface);
    append_props(&ientry, path, iface);
    dbus_message_iter_close_container(&ifaces, &ientry);
    dbus_message_iter_close_container(&entry, &ifaces);
    dbus_message_iter_close_container(objs, &entry);
}

static DBusMessage *managed_objects(DBusMessage *msg, int advertisement) {
    DBusMessage *r = dbus_message_new_method_return(msg);
    DBusMessageIter it, objs;
    dbus_message_iter_init_append(r, &it);
    dbus_message_iter_open_container(&it, DBUS_TYPE_ARRAY, "{oa{sa{sv}}}", &objs);
    if (advertisement) {
        append_object(&objs, ADV_PATH, "org.bluez.LEAdvertisement1");
    } else {
        append_object(&objs, SVC_PATH, "org.bluez.GattService1");
        append_object(&objs, DATA_PATH, GATT_CHR);
        append_object(&objs, CONTROL_PATH, GATT_CHR);
        append_object(&objs, INFO_PATH, GATT_CHR);
    }
    dbus_message_iter_close_container(&it, &objs);
    return r;
}

/* The "mtu" entry of a ReadValue/WriteValue options dict (BlueZ passes the link's ATT MTU there). */
static void note_mtu(DBusMessageIter *opts) {
    DBusMessageIter dict;
    if (dbus_message_iter_get_arg_type(opts) != DBUS_TYPE_ARRAY) return;
    dbus_message_iter_recurse(opts, &dict);
    while (dbus_message_iter_get_arg_type(&dict) == DBUS_TYPE_DICT_ENTRY) {
        DBusMessageIter entry, var;
        const char *key = NULL;
        dbus_message_iter_recurse(&dict, &entry);
        dbus_message_iter_get_basic(&entry, &key);
        dbus_message_iter_next(&entry);
        dbus_message_iter_recurse(&entry, &var);
        if (key != NULL && strcmp(key, "mtu") == 0 && dbus_message_iter_get_arg_type(&var) == DBUS_TYPE_UINT16) {
            dbus_uint16_t mtu;
            dbus_message_iter_get_basic(&var, &mtu);
            if (mtu >= 23) current_mtu = mtu;
        }
        dbus_message_iter_next(&dict);
    }
}

static DBusMessage *byte_array_reply(DBusMessage *msg, const uint8_t *b, int n) {
    DBusMessage *r = dbus_message_new_method_return(msg);
    dbus_message_append_args(r, DBUS_TYPE_ARRAY, DBUS_TYPE_BYTE, &b, n, DBUS_TYPE_INVALID);
    return r;
}

static int transport_notify(void *ctx, const uint8_t *data, uint16_t len);
static uint16_t transport_mtu(void *ctx);
static int transport_can_send(void *ctx);

static void open_session(void) {
    ferry_transport t;
    t.ctx = NULL;
    t.notify = transport_notify;
    t.mtu = transport_mtu;
    t.can_send = transport_can_send;
    ferry_conn_open(&conn, &per, &t);
    ferry_conn_subscribe(&conn, notifying);
}

static DBusHandlerResult on_message(DBusConnection *c, DBusMessage *msg, void *data) {
    const char *path = dbus_message_get_path(msg), *iface = dbus_message_get_interface(msg),
               *member = dbus_message_get_member(msg);
    DBusMessage *reply = NULL;
    (void)data;
    if (path == NULL || member == NULL || dbus_message_get_type(msg) != DBUS_MESSAGE_TYPE_METHOD_CALL)
        return DBUS_HANDLER_RESULT_NOT_YET_HANDLED;
    if (strcmp(member, "GetManagedObjects") == 0) {
        reply = managed_objects(msg, strcmp(path, ADV_PATH) == 0);
    } else if (iface != NULL && strcmp(iface, DBUS_INTERFACE_PROPERTIES) == 0 && strcmp(member, "GetAll") == 0) {
        const char *want = NULL;
        DBusMessageIter it;
        if (dbus_message_get_args(msg, NULL, DBUS_TYPE_STRING, &want, DBUS_TYPE_INVALID)) {
            reply = dbus_message_new_method_return(msg);
            dbus_message_iter_init_append(reply, &it);
            if (!append_props(&it, path, want)) {
                dbus_message_unref(reply);
                reply = dbus_message_new_error(msg, DBUS_ERROR_INVALID_ARGS, "no such interface");
            }
        }
    } else if (strcmp(member, "WriteValue") == 0 && strcmp(path, CONTROL_PATH) == 0) {
        DBusMessageIter it, arr;
        const uint8_t *bytes = NULL;
        int n = 0;
        dbus_message_iter_init(msg, &it);
        if (dbus_message_iter_get_arg_type(&it) == DBUS_TYPE_ARRAY) {
            dbus_message_iter_recurse(&it, &arr);
            dbus_message_iter_get_fixed_array(&arr, &bytes, &n);
            dbus_message_iter_next(&it);
            note_mtu(&it);
            if (!conn.active) { connected = 1; open_session(); } /* first write of a link we missed */
            {
                ferry_control_kind k = ferry_on_control(&conn, bytes, (size_t)n);
                if (k != FERRY_CTL_SYNC_REQ && k != FERRY_CTL_SYNC_ACK)
                    fprintf(stderr, "ferry-peripheral: malformed CONTROL write (%d bytes, kind %d) ignored\n", n, (int)k);
                else if (k == FERRY_CTL_SYNC_REQ)
                    fprintf(stderr, "ferry-peripheral: SYNC_REQ (mtu %u, oldest %llu head %llu)\n", current_mtu,
                            (unsigned long long)ferry_oldest(&per), (unsigned long long)per.meta.head);
            }
        }
        reply = dbus_message_new_method_return(msg);
    } else if (strcmp(member, "ReadValue") == 0 && strcmp(path, INFO_PATH) == 0) {
        uint8_t info[FERRY_STREAM_INFO_LEN];
        DBusMessageIter it;
        dbus_message_iter_init(msg, &it);
        note_mtu(&it);
        ferry_stream_info(&per, info);
        reply = byte_array_reply(msg, info, (int)sizeof info);
    } else if (strcmp(member, "StartNotify") == 0 && strcmp(path, DATA_PATH) == 0) {
        notifying = 1;
        connected = 1; /* a link that appeared as a new device object (no Connected change signal) */
        if (!conn.active) open_session();
        ferry_conn_subscribe(&conn, 1);
        reply = dbus_message_new_method_return(msg);
    } else if (strcmp(member, "StopNotify") == 0 && strcmp(path, DATA_PATH) == 0) {
        notifying = 0;
        ferry_conn_subscribe(&conn, 0);
        reply = dbus_message_new_method_return(msg);
    } else if (strcmp(member, "Release") == 0) {
        fprintf(stderr, "ferry-peripheral: bluetoothd released %s\n", path);
        reply = dbus_message_new_method_return(msg);
    } else {
        reply = dbus_message_new_error(msg, "org.bluez.Error.NotSupported", member);
    }
    if (reply != NULL) {
        dbus_connection_send(c, reply, NULL);
        dbus_message_unref(reply);
    }
    return DBUS_HANDLER_RESULT_HANDLED;
}

/* Device1.Connected changes: a link drop ends the session (mid-frame or not); a new link starts one. */
static DBusHandlerResult on_signal_msg(DBusConnection *c, DBusMessage *msg, void *data) {
    DBusMessageIter it, dict;
    const char *iface = NULL, *path = dbus_message_get_path(msg);
    char prefix[64];
    (void)c;
    (void)data;
    if (!dbus_message_is_signal(msg, DBUS_INTERFACE_PROPERTIES, "PropertiesChanged") || path == NULL)
        return DBUS_HANDLER_RESULT_NOT_YET_HANDLED;
    /* Only links of our adapter: the same bluetoothd also reports other adapters' devices. */
    snprintf(prefix, sizeof prefix, "/org/bluez/%s/", opt.adapter);
    if (strncmp(path, prefix, strlen(prefix)) != 0) return DBUS_HANDLER_RESULT_NOT_YET_HANDLED;
    if (!dbus_message_iter_init(msg, &it) || dbus_message_iter_get_arg_type(&it) != DBUS_TYPE_STRING)
        return DBUS_HANDLER_RESULT_NOT_YET_HANDLED;
    dbus_message_iter_get_basic(&it, &iface);
    if (strcmp(iface, "org.bluez.Device1") != 0 || !dbus_message_iter_next(&it) ||
        dbus_message_iter_get_arg_type(&it) != DBUS_TYPE_ARRAY)
        return DBUS_HANDLER_RESULT_NOT_YET_HANDLED;
    dbus_message_iter_recurse(&it, &dict);
    while (dbus_message_iter_get_arg_type(&dict) == DBUS_TYPE_DICT_ENTRY) {
        DBusMessageIter entry, var;
        const char *key = NULL;
        dbus_message_iter_recurse(&dict, &entry);
        dbus_message_iter_get_basic(&entry, &key);
        dbus_message_iter_next(&entry);
        dbus_message_iter_recurse(&entry, &var);
        if (strcmp(key, "Connected") == 0 && dbus_message_iter_get_arg_type(&var) == DBUS_TYPE_BOOLEAN) {
            dbus_bool_t up;
            dbus_message_iter_get_basic(&var, &up);
            fprintf(stderr, "ferry-peripheral: central %s (%s)\n", up ? "connected" : "disconnected",
                    dbus_message_get_path(msg));
            if (up) {
                connected = 1;
                current_mtu = 23;
                open_session();
            } else {
                connected = 0;
                ferry_conn_close(&conn);
            }
        }
        dbus_message_iter_next(&dict);
    }
    return DBUS_HANDLER_RESULT_NOT_YET_HANDLED;
}

/* ---------------------------------------------------------------- transport callbacks */

static int transport_notify(void *ctx, const uint8_t *data, uint16_t len) {
    DBusMessage *sig;
    DBusMessageIter it, dict, entry, var, arr, inv;
    const char *iface = GATT_CHR, *key = "Value";
    (void)ctx;
    sig = dbus_message_new_signal(DATA_PATH, DBUS_INTERFACE_PROPERTIES, "PropertiesChanged");
    if (sig == NULL) return FERRY_ERR_BUSY;
    dbus_message_iter_init_append(sig, &it);
    dbus_message_iter_append_basic(&it, DBUS_TYPE_STRING, &iface);
    dbus_message_iter_open_container(&it, DBUS_TYPE_ARRAY, "{sv}", &dict);
    dbus_message_iter_open_container(&dict, DBUS_TYPE_DICT_ENTRY, NULL, &entry);
    dbus_message_iter_append_basic(&entry, DBUS_TYPE_STRING, &key);
    dbus_message_iter_open_container(&entry, DBUS_TYPE_VARIANT, "ay", &var);
    dbus_message_iter_open_container(&var, DBUS_TYPE_ARRAY, "y", &arr);
    dbus_message_iter_append_fixed_array(&arr, DBUS_TYPE_BYTE, &data, (int)len);
    dbus_message_iter_close_container(&var, &arr);
    dbus_message_iter_close_container(&entry, &var);
    dbus_message_iter_close_container(&dict, &entry);
    dbus_message_iter_close_container(&it, &dict);
    dbus_message_iter_open_container(&it, DBUS_TYPE_ARRAY, "s", &inv);
    dbus_message_iter_close_container(&it, &inv);
    if (!dbus_connection_send(bus, sig, NULL)) {
        dbus_message_unref(sig);
        return FERRY_ERR_BUSY;
    }
    dbus_message_unref(sig);
    notes_this_tick++;
    return FERRY_OK;
}

static uint16_t transport_mtu(void *ctx) {
    (void)ctx;
    return current_mtu;
}

static int transport_can_send(void *ctx) {
    (void)ctx;
    /* Pace to --notify-rate and keep little queued on the bus, so a new SYNC_REQ takes effect quickly. */
    return connected && notes_this_tick < 8 && dbus_connection_get_outgoing_size(bus) < 8192;
}

/* ---------------------------------------------------------------- registration and main loop */

static void registered(DBusPendingCall *pending, void *what) {
    DBusMessage *r = dbus_pending_call_steal_reply(pending);
    if (r != NULL && dbus_message_get_type(r) == DBUS_MESSAGE_TYPE_ERROR) {
        fprintf(stderr, "ferry-peripheral: %s failed: %s\n", (const char *)what, dbus_message_get_error_name(r));
        stop_requested = 2;
    } else {
        fprintf(stderr, "ferry-peripheral: %s ok\n", (const char *)what);
    }
    if (r != NULL) dbus_message_unref(r);
    dbus_pending_call_unref(pending);
}

static int call_register(const char *iface, const char *method, const char *object, const char *what) {
    char adapter_path[64];
    DBusMessage *m;
    DBusMessageIter it, dict;
    DBusPendingCall *pending = NULL;
    snprintf(adapter_path, sizeof adapter_path, "/org/bluez/%s", opt.adapter);
    m = dbus_message_new_method_call("org.bluez", adapter_path, iface, method);
    if (m == NULL) return -1;
    dbus_message_iter_init_append(m, &it);
    dbus_message_iter_append_basic(&it, DBUS_TYPE_OBJECT_PATH, &object);
    dbus_message_iter_open_container(&it, DBUS_TYPE_ARRAY, "{sv}", &dict);
    dbus_message_iter_close_container(&it, &dict);
    /* Asynchronous: bluetoothd calls GetManagedObjects on us before it answers. */
    if (!dbus_connection_send_with_reply(bus, m, &pending, 20000) || pending == NULL) {
        dbus_message_unref(m);
        return -1;
    }
    dbus_pending_call_set_notify(pending, registered, (void *)what, NULL);
    dbus_message_unref(m);
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void generate(unsigned long n) {
    uint8_t b[FERRY_MAX_PAYLOAD];
    while (n--) {
        uint64_t seq = per.meta.head + 1;
        unsigned i;
        int rc;
        for (i = 0; i < opt.payload_bytes; i++) b[i] = (uint8_t)(seq >> (8 * (i % 8)));
        rc = ferry_append(&per, b, (uint16_t)opt.payload_bytes, NULL);
        if (rc != FERRY_OK) {
            fprintf(stderr, "ferry-peripheral: append failed (%d)%s\n", rc, rc == FERRY_ERR_FULL ? ": store full" : "");
            return;
        }
    }
}

int main(int argc, char **argv) {
    static const DBusObjectPathVTable vt = {NULL, on_message, NULL, NULL, NULL, NULL};
    DBusError err;
    ferry_storage st;
    ferry_meta loaded = {0, 0, 0};
    double last, owed = 0, notes_owed = 0;
    char line[FERRY_MAX_PAYLOAD + 2];

    if (parse_args(argc, argv) != 0) { usage(stderr); return 2; }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    if (ferry_ram_store_init(&rs, ram, sizeof ram, (uint16_t)FERRY_MAX_PAYLOAD) != FERRY_OK) return 1;
    if (load_state(&loaded) != 0) return 1;
    st = ferry_ram_store_callbacks(&rs);
    st.append = file_append;
    st.delete_through = file_delete_through;
    st.persist = file_persist;
    if (ferry_init(&per, &st, random_bytes, NULL, loaded.epoch ? &loaded : NULL) != FERRY_OK) {
        fprintf(stderr, "ferry-peripheral: cannot initialise the store (random source or %s)\n",
                opt.state_dir ? opt.state_dir : "memory");
        return 1;
    }
    generate(opt.generate);

    dbus_error_init(&err);
    bus = dbus_bus_get(DBUS_BUS_SYSTEM, &err);
    if (bus == NULL) {
        fprintf(stderr, "ferry-peripheral: system bus: %s\n", err.message);
        return 1;
    }
    if (!dbus_connection_register_fallback(bus, APP_PATH, &vt, NULL) ||
        !dbus_connection_add_filter(bus, on_signal_msg, NULL, NULL)) {
        fprintf(stderr, "ferry-peripheral: out of memory registering objects\n");
        return 1;
    }
    dbus_bus_add_match(bus, "type='signal',sender='org.bluez',interface='org.freedesktop.DBus.Properties',"
                            "member='PropertiesChanged',arg0='org.bluez.Device1'", NULL);
    if (call_register("org.bluez.GattManager1", "RegisterApplication", APP_PATH, "RegisterApplication") != 0 ||
        call_register("org.bluez.LEAdvertisingManager1", "RegisterAdvertisement", ADV_PATH, "RegisterAdvertisement") != 0) {
        fprintf(stderr, "ferry-peripheral: cannot call bluetoothd\n");
        return 1;
    }
    fprintf(stderr, "ferry-peripheral: %s, epoch %llu, head %llu, oldest %llu\n", opt.adapter,
            (unsigned long long)per.meta.epoch, (unsigned long long)per.meta.head,
            (unsigned long long)ferry_oldest(&per));
    if (opt.from_stdin) fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);

    last = now_s();
    while (!stop_requested) {
        double t;
        unsigned budget;
        if (!dbus_connection_read_write_dispatch(bus, 5)) break; /* the bus went away */
        t = now_s();
        owed += opt.rate * (t - last);
        if (owed >= 1) {
            generate((unsigned long)owed);
            owed -= (double)(unsigned long)owed;
        }
        if (opt.from_stdin) {
            while (fgets(line, sizeof line, stdin) != NULL) {
                size_t n = strcspn(line, "\n");
                if (ferry_append(&per, (const uint8_t *)line, (uint16_t)n, NULL) != FERRY_OK)
                    fprintf(stderr, "ferry-peripheral: append failed\n");
            }
            clearerr(stdin);
        }
        notes_owed += opt.notify_rate * (t - last);
        if (notes_owed > 8) notes_owed = 8; /* no bursts after an idle spell */
        budget = (unsigned)notes_owed;
        last = t;
        notes_this_tick = 0;
        if (budget > 0 && conn.active) {
            int sent = ferry_pump(&conn, budget);
            if (sent < 0) fprintf(stderr, "ferry-peripheral: notify failed\n");
            else notes_owed -= sent;
        }
        dbus_connection_flush(bus);
    }
    fprintf(stderr, "ferry-peripheral: stopping (head %llu, oldest %llu)\n", (unsigned long long)per.meta.head,
            (unsigned long long)ferry_oldest(&per));
    return stop_requested == 2 ? 1 : 0;
}

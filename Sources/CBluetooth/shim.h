#ifndef FERRY_CBLUETOOTH_SHIM_H
#define FERRY_CBLUETOOTH_SHIM_H
#include <bluetooth/bluetooth.h>
#include <bluetooth/hci.h>
#include <errno.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

/* HCIDEVDOWN / HCIDEVUP on controller hciN through a raw HCI socket (needs CAP_NET_ADMIN). The ioctl numbers
 * are function-like macros Swift cannot import, hence these wrappers. Return 0, or -errno. */
static inline int ferry_hci_dev_ioctl(int dev_id, int up) {
    int fd = socket(AF_BLUETOOTH, SOCK_RAW | SOCK_CLOEXEC, BTPROTO_HCI);
    if (fd < 0) return -errno;
    int result = ioctl(fd, up ? HCIDEVUP : HCIDEVDOWN, dev_id) < 0 ? -errno : 0;
    close(fd);
    return result;
}
static inline int ferry_hci_dev_down(int dev_id) { return ferry_hci_dev_ioctl(dev_id, 0); }
static inline int ferry_hci_dev_up(int dev_id) { return ferry_hci_dev_ioctl(dev_id, 1); }
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* One management command on the kernel's control channel (HCI_CHANNEL_CONTROL) and its answer: writes
 * opcode/index/params, reads until the Command Complete or Command Status event for that opcode (other events,
 * e.g. devices found, are skipped), all within `timeout_ms` however many other events arrive. Returns the mgmt
 * status (0 = success), or -errno. */
static inline int ferry_mgmt_command(int fd, uint16_t opcode, uint16_t index, const uint8_t *params, uint16_t length,
                                     int timeout_ms) {
    uint8_t buffer[512];
    if (length > sizeof(buffer) - 6) return -EINVAL;
    buffer[0] = opcode & 0xff; buffer[1] = opcode >> 8;
    buffer[2] = index & 0xff; buffer[3] = index >> 8;
    buffer[4] = length & 0xff; buffer[5] = length >> 8;
    if (length) memcpy(buffer + 6, params, length);
    if (write(fd, buffer, 6 + length) != 6 + length) return -errno;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long deadline_ms = (long long)now.tv_sec * 1000 + now.tv_nsec / 1000000 + timeout_ms;
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long left = deadline_ms - ((long long)now.tv_sec * 1000 + now.tv_nsec / 1000000);
        if (left <= 0) return -ETIMEDOUT;
        struct pollfd p = { .fd = fd, .events = POLLIN };
        int ready = poll(&p, 1, (int)left);
        if (ready < 0) return -errno;
        if (ready == 0) return -ETIMEDOUT;
        ssize_t n = read(fd, buffer, sizeof(buffer));
        if (n < 0) return -errno;
        if (n < 9) continue;
        uint16_t event = buffer[0] | (buffer[1] << 8);
        uint16_t answered = buffer[6] | (buffer[7] << 8);
        if ((event == 0x0001 || event == 0x0002) && answered == opcode) return buffer[8];
    }
}

/* A socket on the kernel's management channel (HCI_CHANNEL_CONTROL), or -errno. */
static inline int ferry_mgmt_open(void) {
    int fd = socket(AF_BLUETOOTH, SOCK_RAW | SOCK_CLOEXEC, BTPROTO_HCI);
    if (fd < 0) return -errno;
    struct sockaddr_hci address;
    memset(&address, 0, sizeof(address));
    address.hci_family = AF_BLUETOOTH;
    address.hci_dev = HCI_DEV_NONE;
    address.hci_channel = HCI_CHANNEL_CONTROL;
    if (bind(fd, (struct sockaddr *)&address, sizeof(address)) < 0) {
        int error = -errno;
        close(fd);
        return error;
    }
    return fd;
}

/* Starts and stops an LE discovery in the kernel for controller hciN (needs CAP_NET_ADMIN). The kernel
 * announces both to every management client, bluetoothd included, which resets its view of whether the
 * controller discovers. Nothing is done when the kernel already discovers (Start answers Busy).
 * Returns 0 (kicked), 1 (the kernel was discovering: nothing done), or -errno / -(0x100 + mgmt status). */
static inline int ferry_mgmt_discovery_kick(int dev_id) {
    int fd = ferry_mgmt_open();
    if (fd < 0) return fd;
    uint8_t type = 0x06; /* LE public and random */
    int status = ferry_mgmt_command(fd, 0x0023 /* Start Discovery */, (uint16_t)dev_id, &type, 1, 5000);
    int result;
    if (status == 0x0a /* Busy */) {
        result = 1;
    } else if (status != 0) {
        result = status < 0 ? status : -(0x100 + status);
    } else {
        status = ferry_mgmt_command(fd, 0x0024 /* Stop Discovery */, (uint16_t)dev_id, &type, 1, 5000);
        result = status == 0 ? 0 : (status < 0 ? status : -(0x100 + status));
    }
    close(fd);
    return result;
}
/* Disconnects the LE link to `address` (6 bytes as written, most significant first) on controller hciN through
 * the kernel's management channel (needs CAP_NET_ADMIN). The kernel answers once the controller reported the
 * link down, and announces it to every management client (bluetoothd included). `address_type`: 1 LE public,
 * 2 LE random. Returns 0, or -errno / -(0x100 + mgmt status). */
static inline int ferry_mgmt_disconnect(int dev_id, const uint8_t address[6], uint8_t address_type, int timeout_ms) {
    int fd = ferry_mgmt_open();
    if (fd < 0) return fd;
    uint8_t params[7];
    for (int i = 0; i < 6; i++) params[i] = address[5 - i]; /* bdaddr_t is little-endian */
    params[6] = address_type;
    int status = ferry_mgmt_command(fd, 0x0014 /* Disconnect */, (uint16_t)dev_id, params, sizeof(params), timeout_ms);
    close(fd);
    return status == 0 ? 0 : (status < 0 ? status : -(0x100 + status));
}
#endif

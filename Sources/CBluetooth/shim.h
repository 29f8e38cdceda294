#ifndef FERRY_CBLUETOOTH_SHIM_H
#define FERRY_CBLUETOOTH_SHIM_H
#include <bluetooth/bluetooth.h>
#include <bluetooth/hci.h>
#include <errno.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

/* HCIDEVRESET on controller hciN through a raw HCI socket (needs CAP_NET_ADMIN). The ioctl number is a
 * function-like macro Swift cannot import, hence this wrapper. Returns 0, or -errno. */
static inline int ferry_hci_dev_reset(int dev_id) {
    int fd = socket(AF_BLUETOOTH, SOCK_RAW | SOCK_CLOEXEC, BTPROTO_HCI);
    if (fd < 0) return -errno;
    int result = ioctl(fd, HCIDEVRESET, dev_id) < 0 ? -errno : 0;
    close(fd);
    return result;
}
#endif

/*
 * vhci_relay: the guest's end of the bed's "peripherals on the host" layout.
 *
 * The emulated controller (bumble, peripheral.py) runs on the host at native speed and speaks H4 over a
 * virtio-serial port; this relay copies packets between that port and /dev/vhci, where the kernel sees the
 * controller as hci0. /dev/vhci takes exactly one packet per write(2) and gives one per read(2), while the
 * port is a byte stream, so packets from the port are framed by their H4 headers here.
 *
 * Usage: vhci_relay PORT [VHCI]   (VHCI defaults to /dev/vhci). Runs until either side closes.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

enum { H4_COMMAND = 0x01, H4_ACL = 0x02, H4_SCO = 0x03, H4_EVENT = 0x04, H4_ISO = 0x05, H4_VENDOR = 0xff };

static int write_all(int fd, const uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Length of the whole H4 packet at p (type byte included) once its header is in, 0 if more bytes are needed,
 * -1 if the type is unknown (the stream is out of step: nothing sensible can follow). */
static long h4_length(const uint8_t *p, size_t have) {
    if (have < 1) return 0;
    switch (p[0]) {
    case H4_COMMAND: return have < 4 ? 0 : 4L + p[3];
    case H4_ACL: return have < 5 ? 0 : 5L + (p[3] | (p[4] << 8));
    case H4_SCO: return have < 4 ? 0 : 4L + p[3];
    case H4_EVENT: return have < 3 ? 0 : 3L + p[2];
    case H4_ISO: return have < 5 ? 0 : 5L + ((p[3] | (p[4] << 8)) & 0x3fff);
    default: return -1;
    }
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: vhci_relay PORT [VHCI]\n");
        return 2;
    }
    const char *vhci_path = argc == 3 ? argv[2] : "/dev/vhci";
    int port = open(argv[1], O_RDWR | O_NOCTTY);
    if (port < 0) {
        fprintf(stderr, "vhci_relay: %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    int vhci = open(vhci_path, O_RDWR);
    if (vhci < 0) {
        fprintf(stderr, "vhci_relay: %s: %s\n", vhci_path, strerror(errno));
        return 1;
    }
    /* Create the controller now (a primary one) rather than after vhci's 1 s grace period. */
    const uint8_t create[2] = {H4_VENDOR, 0x00};
    if (write_all(vhci, create, sizeof create) < 0) {
        fprintf(stderr, "vhci_relay: creating the controller: %s\n", strerror(errno));
        return 1;
    }
    static uint8_t in[1 << 17];  /* from the port: a byte stream, framed here */
    size_t have = 0;
    static uint8_t out[1 << 16]; /* from vhci: one packet per read */
    unsigned long to_kernel = 0, to_controller = 0, refused = 0;
    struct pollfd fds[2] = {{.fd = vhci, .events = POLLIN}, {.fd = port, .events = POLLIN}};
    for (;;) {
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR) continue;
            perror("vhci_relay: poll");
            return 1;
        }
        if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t n = read(vhci, out, sizeof out);
            if (n <= 0) {
                fprintf(stderr, "vhci_relay: /dev/vhci closed (%s)\n", n < 0 ? strerror(errno) : "end of file");
                break;
            }
            /* The vendor packet answering the creation (ff 00 INDEX) is for this end only. */
            if (out[0] != H4_VENDOR) {
                if (write_all(port, out, (size_t)n) < 0) {
                    perror("vhci_relay: write to the port");
                    break;
                }
                to_controller++;
            }
        }
        if (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t n = read(port, in + have, sizeof in - have);
            if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            if (n <= 0) {
                /* A virtio port reads end-of-file while nobody is connected on the host: wait for them. */
                if (n == 0) {
                    usleep(20000);
                    continue;
                }
                perror("vhci_relay: read from the port");
                break;
            }
            have += (size_t)n;
            size_t at = 0;
            for (;;) {
                long len = h4_length(in + at, have - at);
                if (len < 0) {
                    fprintf(stderr, "vhci_relay: unknown H4 packet type 0x%02x from the host: stopping\n", in[at]);
                    return 1;
                }
                if (len == 0 || (size_t)len > have - at) break;
                if (write_all(vhci, in + at, (size_t)len) == 0) {
                    to_kernel++;
                } else if (errno == ENXIO) {
                    /* The kernel refuses packets while hci0 is down (bluetoothd powered it off with links
                     * still up): a real transport loses them too. Closing /dev/vhci would unregister hci0. */
                    if (refused++ == 0) fprintf(stderr, "vhci_relay: hci0 is down: dropping packets for it\n");
                } else {
                    perror("vhci_relay: write to /dev/vhci");
                    return 1;
                }
                at += (size_t)len;
            }
            memmove(in, in + at, have - at);
            have -= at;
        }
    }
    fprintf(stderr, "vhci_relay: %lu packets to the kernel (%lu refused while hci0 was down), %lu to the controller\n",
            to_kernel, refused, to_controller);
    return 0;
}

#ifndef FERRY_CBLUETOOTH_SHIM_H
#define FERRY_CBLUETOOTH_SHIM_H
#include <bluetooth/bluetooth.h>
#endif

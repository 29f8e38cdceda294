/// The two libsystemd functions the static libdbus refers to. libdbus calls them only in a bus *server* started
/// by systemd's socket activation (a "systemd:" listen address), which Ferry, a client, never creates; the
/// answers are those of a process that systemd passed no sockets to.

/// `sd_listen_fds(3)`: no file descriptors were passed.
@_cdecl("sd_listen_fds")
func sd_listen_fds(_ unsetEnvironment: Int32) -> Int32 { 0 }

/// `sd_is_socket(3)`: the descriptor is not a socket of the asked kind.
@_cdecl("sd_is_socket")
func sd_is_socket(_ fd: Int32, _ family: Int32, _ type: Int32, _ listening: Int32) -> Int32 { 0 }

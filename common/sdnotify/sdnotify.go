// Package sdnotify speaks systemd's service notification protocol (sd_notify(3)):
// one datagram per message to the Unix socket named by $NOTIFY_SOCKET. With
// Type=notify the unit is active only once the shim says READY=1, and with
// WatchdogSec systemd restarts a shim that stops sending WATCHDOG=1.
package sdnotify

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"time"
)

// Notifier sends to one socket. The zero value (no $NOTIFY_SOCKET) sends
// nothing and reports no error: outside systemd the calls are no-ops.
type Notifier struct {
	addr string
}

// FromEnv reads $NOTIFY_SOCKET ("@name" is an abstract socket).
func FromEnv() Notifier { return Notifier{addr: os.Getenv("NOTIFY_SOCKET")} }

// Enabled reports whether there is a socket to talk to.
func (n Notifier) Enabled() bool { return n.addr != "" }

// Send sends state, e.g. "READY=1" or "WATCHDOG=1".
func (n Notifier) Send(state string) error {
	if n.addr == "" {
		return nil
	}
	// Go maps a leading '@' to an abstract socket, as systemd means it.
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: n.addr, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("notify %s: %w", n.addr, err)
	}
	defer c.Close()
	if _, err := c.Write([]byte(state)); err != nil {
		return fmt.Errorf("notify %s: %w", n.addr, err)
	}
	return nil
}

// WatchdogInterval is systemd's watchdog timeout for this process
// ($WATCHDOG_USEC, when $WATCHDOG_PID is unset or ours); 0 without one.
// Send WATCHDOG=1 at half of it.
func WatchdogInterval() time.Duration {
	if pid := os.Getenv("WATCHDOG_PID"); pid != "" && pid != strconv.Itoa(os.Getpid()) {
		return 0
	}
	usec, err := strconv.ParseInt(os.Getenv("WATCHDOG_USEC"), 10, 64)
	if err != nil || usec <= 0 {
		return 0
	}
	return time.Duration(usec) * time.Microsecond
}

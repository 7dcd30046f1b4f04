package sdnotify

import (
	"net"
	"path/filepath"
	"testing"
	"time"
)

func TestSendAndWatchdog(t *testing.T) {
	for _, name := range []string{filepath.Join(t.TempDir(), "notify.sock"), "@tandem-test-notify"} {
		ln, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: name, Net: "unixgram"})
		if err != nil {
			t.Fatal(err)
		}
		t.Setenv("NOTIFY_SOCKET", name)
		n := FromEnv()
		if !n.Enabled() {
			t.Fatal("not enabled")
		}
		if err := n.Send("READY=1"); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 64)
		_ = ln.SetReadDeadline(time.Now().Add(2 * time.Second))
		k, err := ln.Read(buf)
		if err != nil || string(buf[:k]) != "READY=1" {
			t.Fatalf("%s: %q %v", name, buf[:k], err)
		}
		ln.Close()
	}
	t.Setenv("NOTIFY_SOCKET", "")
	if err := FromEnv().Send("READY=1"); err != nil {
		t.Fatal("outside systemd Send must be a no-op")
	}
	t.Setenv("WATCHDOG_USEC", "2000000")
	t.Setenv("WATCHDOG_PID", "")
	if WatchdogInterval() != 2*time.Second {
		t.Fatal(WatchdogInterval())
	}
	t.Setenv("WATCHDOG_PID", "1")
	if WatchdogInterval() != 0 {
		t.Fatal("another process's watchdog")
	}
}

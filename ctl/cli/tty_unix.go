//go:build unix

package cli

import (
	"os"
	"os/signal"

	"golang.org/x/sys/unix"
)

// notifyResize sends a window's changes (SIGWINCH) to ch.
func notifyResize(ch chan<- os.Signal) { signal.Notify(ch, unix.SIGWINCH) }

package cli

import (
	"os"
	"os/signal"
	"sync"
	"syscall"
)

// onSignals turns Ctrl-C and SIGTERM into calls: first on the first one,
// again on each later one. The returned stop ends the listening.
func onSignals(first, again func()) (stop func()) {
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		n := 0
		for {
			select {
			case <-done:
				return
			case <-sigs:
				if n++; n == 1 {
					first()
				} else {
					again()
				}
			}
		}
	}()
	return func() {
		signal.Stop(sigs)
		close(done)
		wg.Wait()
	}
}

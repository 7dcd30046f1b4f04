// Command flood holds many connections to an HTTP server the way a hostile
// client would, re-opening each one as soon as it is dropped, until killed:
//
//	flood -addr 127.0.0.1:10998 -n 2000 -mode silent   # connect, send nothing
//	flood -addr ... -n 750 -mode idle                  # one request, then idle keep-alive
//	flood -addr ... -n 750 -mode slowbody              # a body trickling a byte every 5 s
//
// It prints "holding N" once N connections were open at the same time.
// Built by the e2e tests (CGO_ENABLED=0) and run in a container or on the
// host.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"
)

func main() {
	addr := flag.String("addr", "", "host:port")
	n := flag.Int("n", 1000, "connections")
	mode := flag.String("mode", "silent", "silent, idle or slowbody")
	flag.Parse()
	var open, opened atomic.Int64
	var once atomic.Bool
	for range *n {
		go func() {
			for {
				c, err := net.Dial("tcp", *addr)
				if err != nil {
					time.Sleep(10 * time.Millisecond)
					continue
				}
				opened.Add(1)
				if open.Add(1) >= int64(*n) && once.CompareAndSwap(false, true) {
					fmt.Println("holding", *n)
				}
				hold(c, *mode)
				open.Add(-1)
				c.Close()
			}
		}()
	}
	for {
		time.Sleep(5 * time.Second)
		fmt.Fprintf(os.Stderr, "open %d, opened %d\n", open.Load(), opened.Load())
	}
}

// hold keeps c busy in its mode until the server drops it.
func hold(c net.Conn, mode string) {
	switch mode {
	case "idle":
		if _, err := c.Write([]byte("GET /api/healthcheck HTTP/1.1\r\nHost: localhost\r\n\r\n")); err != nil {
			return
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		_, _ = io.Copy(io.Discard, c) // idle until dropped
	case "slowbody":
		if _, err := c.Write([]byte("POST /api/tasks HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{")); err != nil {
			return
		}
		done := make(chan struct{})
		go func() {
			_, _ = io.Copy(io.Discard, c)
			close(done)
		}()
		for {
			select {
			case <-done:
				return
			case <-time.After(5 * time.Second):
				if _, err := c.Write([]byte(" ")); err != nil {
					return
				}
			}
		}
	default:
		_, _ = io.Copy(io.Discard, c)
	}
}

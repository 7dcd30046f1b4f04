// Command probe asks an HTTP server for one path on a kept-alive
// connection at a fixed interval and prints each answer's time, until its
// stdin closes:
//
//	nice -n -20 probe -addr 127.0.0.1:10998 -path /api/tasks/ID -every 10ms
//
// Each line is "<unix ns when sent> <µs until the whole answer was read>
// <status>". Run at the highest CPU priority on one thread, it stands for
// a client on another machine (the dstack server): its figures are the
// server's wait, not its own for a busy host's CPUs. Built by the e2e
// benchmarks.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"time"
)

func main() {
	addr := flag.String("addr", "", "host:port")
	path := flag.String("path", "/", "the path asked for")
	every := flag.Duration("every", 10*time.Millisecond, "interval between requests")
	flag.Parse()
	runtime.GOMAXPROCS(1)
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(done)
	}()
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	req := []byte("GET " + *path + " HTTP/1.1\r\nHost: " + *addr + "\r\n\r\n")
	var conn net.Conn
	var br *bufio.Reader
	tick := time.NewTicker(*every)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
		}
		if conn == nil {
			c, err := net.DialTimeout("tcp", *addr, 5*time.Second)
			if err != nil {
				fmt.Fprintln(os.Stderr, "probe:", err)
				continue
			}
			conn, br = c, bufio.NewReader(c)
		}
		t0 := time.Now()
		status, err := ask(conn, br, req)
		took := time.Since(t0)
		if err != nil {
			fmt.Fprintln(os.Stderr, "probe:", err)
			conn.Close()
			conn = nil
			continue
		}
		fmt.Fprintf(out, "%d %d %d\n", t0.UnixNano(), took.Microseconds(), status)
	}
}

// ask sends req and reads the whole answer.
func ask(conn net.Conn, br *bufio.Reader, req []byte) (int, error) {
	if err := conn.SetDeadline(time.Now().Add(30 * time.Second)); err != nil {
		return 0, err
	}
	if _, err := conn.Write(req); err != nil {
		return 0, err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return 0, err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, err
}

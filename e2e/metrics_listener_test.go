package e2e

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// TestMetricsListenerSharesItsSlots: on the real shim's --metrics-address,
// one peer (127.0.0.1) opening 64 connections, twice the listener's slots,
// asking for keep-alive or sending its request line a byte at a time, does
// not keep another peer's scrape (from 127.0.0.2: loopback takes any
// source in 127/8) waiting; kept-alive connections are closed once
// answered, and the holder keeps at most its share (8) open. Before, the
// first 32 connections held every slot for their 60 s idle timeout,
// renewed by a request every 20 s, and scrapes timed out.
func TestMetricsListenerSharesItsSlots(t *testing.T) {
	testenv.RequireDocker(t)
	bins := testenv.Binaries(t)
	maddr := testenv.FreeAddr(t)
	startShim(t, bins.Runner, nil, "--metrics-address", maddr)
	for _, tc := range []struct{ name, first string }{
		{"kept alive", "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n"},
		{"slow request line", "GET /met"},
	} {
		t.Run(tc.name, func(t *testing.T) { holdAndScrape(t, maddr, tc.first) })
	}
}

// holdAndScrape opens 64 connections from 127.0.0.1 that send first (and
// read the answer, if first is a whole request), then scrapes from
// 127.0.0.2, and counts the holder's connections still open.
func holdAndScrape(t *testing.T, maddr, first string) {
	const holders, share = 64, 8
	deadline := time.Now().Add(10 * time.Second)
	conns := make([]net.Conn, 0, holders)
	for range holders {
		c, err := net.Dial("tcp", maddr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := io.WriteString(c, first); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	whole := strings.HasSuffix(first, "\r\n\r\n")
	answers := 0
	for _, c := range conns {
		if !whole {
			break
		}
		_ = c.SetReadDeadline(deadline)
		if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			answers++
		}
	}

	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}}
	resp, err := client.Get("http://" + maddr + "/metrics")
	if err != nil {
		t.Fatalf("a scrape from 127.0.0.2 beside %d held connections (%d answered): %v", holders, answers, err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "tandem_shim_") {
		t.Fatalf("scrape from 127.0.0.2: %d %.200q", resp.StatusCode, b)
	}
	t.Logf("%d of the holder's %d requests answered; the scrape: %d bytes", answers, holders, len(b))
	if !whole {
		return // a slow sender's connections may wait for a slot, holding none
	}
	open := 0
	for _, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			open++
		}
	}
	if open > share {
		t.Fatalf("the holder keeps %d connections open, past its share of %d", open, share)
	}
}

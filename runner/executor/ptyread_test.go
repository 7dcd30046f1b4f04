package executor

import (
	"bytes"
	"testing"
	"time"

	"github.com/creack/pty"
)

// readyReader delivers what the terminal's other side writes, in order,
// whether it was there before the read or came while the reader waited,
// and ends with an error (EIO) once that side is closed: no hang.
func TestReadyReaderPty(t *testing.T) {
	master, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer master.Close()
	read := readyReader(master)
	want := bytes.Repeat([]byte("0123456789abcdef"), 8<<10) // 128 KiB, many pty buffers
	_, _ = tty.Write([]byte("early\n"))                     // there before the first read
	got := make(chan []byte, 1)
	done := make(chan error, 1)
	go func() {
		var all []byte
		buf := make([]byte, 32<<10)
		for {
			n, err := read(buf)
			all = append(all, buf[:n]...)
			if err != nil {
				got <- all
				done <- err
				return
			}
		}
	}()
	time.Sleep(50 * time.Millisecond) // the reader now waits on an empty terminal
	for off := 0; off < len(want); off += 4000 {
		if _, err := tty.Write(want[off:min(off+4000, len(want))]); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(50 * time.Millisecond)
	tty.Close()
	select {
	case err := <-done:
		t.Logf("the reader ended with %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the reader did not end after the terminal's other side closed")
	}
	all := <-got
	// The terminal turns \n into \r\n on the way.
	if exp := append([]byte("early\r\n"), want...); !bytes.Equal(all, exp) {
		t.Fatalf("read %d bytes, want %d (prefix %q)", len(all), len(exp), all[:min(len(all), 20)])
	}
}

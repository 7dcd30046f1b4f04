package rawnet

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"
)

// allBack reports whether every buffer bufs made is free again.
func allBack(bufs *Buffers) bool {
	bufs.mu.Lock()
	defer bufs.mu.Unlock()
	return len(bufs.free) == bufs.made
}

// waitAllBack fails the test unless every buffer comes back within 5 s
// (a flusher gives its batch back after the write it was in).
func waitAllBack(t *testing.T, bufs *Buffers) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !allBack(bufs); {
		if time.Now().After(deadline) {
			t.Fatalf("write-behind buffers not given back: %d made, %d free", bufs.made, len(bufs.free))
		}
		time.Sleep(time.Millisecond)
	}
}

// Written behind, a stream arrives whole and in order through socket
// buffers far smaller than it, in random-sized writes bigger and smaller
// than the batch buffer, and the half-close comes after the last byte: with
// two buffers (one filling while one is written), with one (a Write that
// finds none free waits for the queue to empty and writes directly), and
// with none at all.
func TestWriteBehindStream(t *testing.T) {
	for _, max := range []int{2, 1, 0} {
		d, a := tcpPair(t)
		_ = d.SetWriteBuffer(64 << 10)
		_ = a.SetReadBuffer(64 << 10)
		bufs := NewBuffers(4096, max)
		w := WrapBuffered(d, nil, bufs)
		r := Wrap(a)
		want := randomBytes(4<<20, uint64(max))
		werr := sendInPieces(w, want, 20<<10, 5)
		got, err := io.ReadAll(r)
		if err != nil {
			t.Fatal(err)
		}
		if err := <-werr; err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%d buffers: got %d bytes, not what was sent (%d)", max, len(got), len(want))
		}
		waitAllBack(t, bufs)
	}
}

// Concurrent Writes each arrive in one piece (as on a plain socket): every
// record's header and body come together, whatever its size against the
// batch buffer.
func TestWriteBehindConcurrentWritesStayWhole(t *testing.T) {
	d, a := tcpPair(t)
	bufs := NewBuffers(8192, 3)
	w := WrapBuffered(d, nil, bufs)
	const writers, records = 4, 300
	var wg sync.WaitGroup
	for id := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(id), 9))
			for seq := range records {
				body := bytes.Repeat([]byte{byte(id)}, rng.IntN(30<<10))
				rec := binary.BigEndian.AppendUint32([]byte{byte(id)}, uint32(len(body)))
				rec = binary.BigEndian.AppendUint32(rec, uint32(seq))
				if _, err := w.Write(append(rec, body...)); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() {
		wg.Wait()
		_ = w.(*Conn).CloseWrite()
		close(done)
	}()
	next := make([]uint32, writers)
	r := io.Reader(a)
	head := make([]byte, 9)
	for {
		if _, err := io.ReadFull(r, head); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		id, size, seq := head[0], binary.BigEndian.Uint32(head[1:]), binary.BigEndian.Uint32(head[5:])
		if int(id) >= writers || seq != next[id] {
			t.Fatalf("record from writer %d numbered %d, want %d: writes interleaved", id, seq, next[min(int(id), writers-1)])
		}
		next[id]++
		body := make([]byte, size)
		if _, err := io.ReadFull(r, body); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(body, bytes.Repeat([]byte{id}, int(size))) {
			t.Fatalf("writer %d's record %d came in pieces", id, seq)
		}
	}
	<-done
	for id, n := range next {
		if n != records {
			t.Fatalf("writer %d: %d records arrived, want %d", id, n, records)
		}
	}
	waitAllBack(t, bufs)
}

// behindPair is a loopback connection with small socket buffers whose
// dialing end writes behind with two 64 KiB buffers.
func behindPair(t *testing.T) (*Conn, *net.TCPConn, *Buffers) {
	t.Helper()
	d, a := tcpPair(t)
	_ = d.SetWriteBuffer(32 << 10)
	_ = a.SetReadBuffer(32 << 10)
	bufs := NewBuffers(64<<10, 2)
	return WrapBuffered(d, nil, bufs).(*Conn), a, bufs
}

// Close sends what was written before it: the peer reads every byte, then
// the end.
func TestWriteBehindCloseSendsWhatWasWritten(t *testing.T) {
	w, a, bufs := behindPair(t)
	want := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
	got := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(a)
		got <- b
	}()
	if _, err := w.Write(want); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if b := <-got; !bytes.Equal(b, want) {
		t.Fatalf("peer read %d bytes of %d before the end", len(b), len(want))
	}
	waitAllBack(t, bufs)
}

// A peer that never reads cannot hold Close: it waits for the queue at
// most closeWait, a Write waiting for room then fails, and the buffers
// come back.
func TestWriteBehindCloseIsBounded(t *testing.T) {
	w, _, bufs := behindPair(t)
	w.behind.closeWait = 100 * time.Millisecond
	werr := make(chan error, 1)
	go func() {
		_, err := w.Write(make([]byte, 16<<20)) // far more than the peer's buffers take
		werr <- err
	}()
	time.Sleep(100 * time.Millisecond) // the Write now waits for room
	start := time.Now()
	_ = w.Close()
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("Close took %v with a peer that does not read", took)
	}
	select {
	case err := <-werr:
		if err == nil {
			t.Fatal("a Write that could not go out before Close succeeded")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the waiting Write did not end with Close")
	}
	waitAllBack(t, bufs)
}

// A connection that breaks fails the Writes after it (the flusher's error,
// a write OpError), and does not keep buffers.
func TestWriteBehindFailureReachesLaterWrites(t *testing.T) {
	d, a := tcpPair(t)
	bufs := NewBuffers(16<<10, 2)
	w := WrapBuffered(d, nil, bufs)
	_ = a.SetLinger(0)
	a.Close() // a reset for what d sends next
	var err error
	chunk := make([]byte, 8<<10)
	for deadline := time.Now().Add(5 * time.Second); err == nil && time.Now().Before(deadline); {
		_, err = w.Write(chunk)
		time.Sleep(time.Millisecond)
	}
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Op != "write" {
		t.Fatalf("write to a reset connection: %v, want a write OpError", err)
	}
	if _, err2 := w.Write(chunk); err2 == nil {
		t.Fatal("a Write after the failure succeeded")
	}
	waitAllBack(t, bufs)
	w.Close()
}

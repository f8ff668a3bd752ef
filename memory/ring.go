package memory

// ring is a double-ended queue over a power-of-two circular buffer. It grows
// by doubling and never shrinks below what it has held, so a queue in steady
// state allocates nothing.
type ring[T any] struct {
	buf  []T
	head int
	n    int
}

func (r *ring[T]) len() int { return r.n }

func (r *ring[T]) grow() {
	c := 2 * len(r.buf)
	if c == 0 {
		c = 16
	}
	buf := make([]T, c)
	for i := 0; i < r.n; i++ {
		buf[i] = r.buf[(r.head+i)&(len(r.buf)-1)]
	}
	r.buf, r.head = buf, 0
}

func (r *ring[T]) pushBack(v T) {
	if r.n == len(r.buf) {
		r.grow()
	}
	r.buf[(r.head+r.n)&(len(r.buf)-1)] = v
	r.n++
}

// front returns the first element; the ring must not be empty.
func (r *ring[T]) front() T { return r.buf[r.head] }

// at returns the i-th element from the front.
func (r *ring[T]) at(i int) T { return r.buf[(r.head+i)&(len(r.buf)-1)] }

// popFront removes and returns the first element; the ring must not be empty.
func (r *ring[T]) popFront() T {
	var zero T
	v := r.buf[r.head]
	r.buf[r.head] = zero
	r.head = (r.head + 1) & (len(r.buf) - 1)
	r.n--
	return v
}

// filter keeps, in order, the elements for which keep returns true.
func (r *ring[T]) filter(keep func(T) bool) {
	var zero T
	w := 0
	for i := 0; i < r.n; i++ {
		v := r.at(i)
		if keep(v) {
			r.buf[(r.head+w)&(len(r.buf)-1)] = v
			w++
		}
	}
	for i := w; i < r.n; i++ {
		r.buf[(r.head+i)&(len(r.buf)-1)] = zero
	}
	r.n = w
}

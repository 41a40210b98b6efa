// A C++ target built -O2 -fomit-frame-pointer (Makefile NOFP_CFLAGS): a
// std::thread (start_thread, then libstdc++'s thread routine) calls a
// class template's member through a namespace's functions, N times, down
// to gfnofp::leaf, the probed function (tests/test_unwind.py).
// Usage: gf_nofp_cc N
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace gfnofp {
static volatile long sink;

__attribute__((noinline)) long leaf(long x)
{
	sink += x;
	return sink & 0xff;
}

template <class T> struct Stage {
	T k;
	__attribute__((noinline)) T run(T x) const
	{
		volatile T pad[20];
		pad[x & 15] = x + k;
		return leaf(pad[x & 15]) + k;
	}
};

__attribute__((noinline)) long outer(long x)
{
	Stage<long> s{x & 7};
	volatile char buf[64];
	buf[x & 31] = 1;
	return s.run(x + buf[x & 31]) * 2;
}
} // namespace gfnofp

int main(int argc, char **argv)
{
	long n = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 1;
	long acc = 0;
	std::thread t([&] {
		for (long i = 0; i < n; i++)
			acc += gfnofp::outer(i);
	});
	t.join();
	std::printf("%ld\n", acc);
	return 0;
}

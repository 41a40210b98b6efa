// A C++ target for the symbolizer's known answers: a namespace, a class
// template and a plain overloaded function, each kept out of line.
#include <cstdio>
#include <cstdlib>

namespace gfns {
template <class T> struct Box {
	T v;
	__attribute__((noinline)) T get(T x) const { return v + x; }
};
} // namespace gfns

__attribute__((noinline)) int foo(int x) { return x * 3; }

int main(int argc, char **argv)
{
	gfns::Box<int> b{argc};
	long n = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 1;
	int acc = 0;
	for (long i = 0; i < n; i++)
		acc += b.get(foo(static_cast<int>(i)));
	std::printf("%d\n", acc);
	return 0;
}

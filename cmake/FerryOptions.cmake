# Compiler flags shared by every ferry target.
find_program(CCACHE_PROGRAM ccache)
if(CCACHE_PROGRAM)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
  set(CMAKE_C_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
endif()

if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "Build type" FORCE)
endif()

set(FERRY_WARNING_FLAGS -Wall -Wextra -Wpedantic -Wno-unused-parameter)
if(FERRY_WERROR)
  list(APPEND FERRY_WARNING_FLAGS -Werror)
endif()

# Coverage for libFuzzer on every library, under ASan and UBSan; fuzz targets link -fsanitize=fuzzer.
if(FERRY_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "FERRY_FUZZ=ON needs clang; scripts/fuzz.sh configures it")
  endif()
  set(FERRY_SANITIZE ON)
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=fuzzer-no-link>)
endif()
if(FERRY_SANITIZE)
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=address,undefined>
                      $<$<COMPILE_LANGUAGE:C,CXX>:-fno-sanitize-recover=undefined>
                      $<$<COMPILE_LANGUAGE:C,CXX>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=address,undefined)
endif()
if(FERRY_TSAN)
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=thread>)
  add_link_options(-fsanitize=thread)
endif()

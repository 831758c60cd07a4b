# ferry_library(NAME SOURCES ... DEPS ...): one library per folder, warnings on.
function(ferry_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  # Installed, the headers keep their paths under include/ferry (cmake/FerryInstall.cmake).
  target_include_directories(${name} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>)
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${FERRY_WARNING_FLAGS}>)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
endfunction()

# ferry_test(NAME LABEL folder SOURCES ... DEPS ...): a GoogleTest binary registered with ctest.
function(ferry_test name)
  cmake_parse_arguments(ARG "" "LABEL;TIMEOUT" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${FERRY_WARNING_FLAGS}>)
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABEL}" TIMEOUT ${ARG_TIMEOUT})
endfunction()

function(ferry_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${FERRY_WARNING_FLAGS}>)
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
endfunction()

# ferry_cuda_sources(LIB files.cu ...): CUDA sources of library LIB, in an object library of their
# own (LIB_cuda) compiled as C++20 (the flag comes from CMAKE_CUDA_FLAGS, see
# cmake/FerryDependencies.cmake), whose objects LIB then holds.
function(ferry_cuda_sources lib)
  add_library(${lib}_cuda OBJECT ${ARGN})
  target_include_directories(${lib}_cuda PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_definitions(${lib}_cuda PRIVATE FERRY_HAVE_CUDA=1)
  target_include_directories(${lib}_cuda SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  target_compile_options(${lib}_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall>
                         # core/status.h: nvcc flags [[nodiscard]] on a class whose void member returns nothing.
                         $<$<COMPILE_LANGUAGE:CUDA>:-diag-suppress=2810>)
  target_sources(${lib} PRIVATE $<TARGET_OBJECTS:${lib}_cuda>)
endfunction()
